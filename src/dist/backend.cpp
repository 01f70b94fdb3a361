#include "dist/backend.h"

#include <vector>

#include "core/error.h"

namespace kt::dist {

namespace {

const char* const kForms =
    "expected \"gloo\", \"nccl\", or device:backend pairs joined by ',' such as \"cuda:nccl,cpu:gloo\"";

kt_comm_backend backend_of(const std::string& name) {
  if (name == "gloo") return KT_COMM_BACKEND_GLOO;
  if (name == "nccl") return KT_COMM_BACKEND_NCCL;
  return KT_COMM_BACKEND_NONE;
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> parts;
  size_t start = 0;
  for (;;) {
    const size_t end = s.find(sep, start);
    parts.push_back(s.substr(start, end == std::string::npos ? std::string::npos : end - start));
    if (end == std::string::npos) return parts;
    start = end + 1;
  }
}

}  // namespace

const char* backend_name(kt_comm_backend b) {
  switch (b) {
    case KT_COMM_BACKEND_GLOO: return "gloo";
    case KT_COMM_BACKEND_NCCL: return "nccl";
    default: return "none";
  }
}

Backends parse_backends(const char* text, const std::string& what) {
  KT_CHECK(text != nullptr, KT_ERR_NULL_POINTER, what + " is NULL");
  const std::string s(text);
  const std::string head = what + " \"" + s + "\": ";
  const auto refuse = [&](const std::string& why) {
    fail(KT_ERR_INVALID_ARGUMENT, head + why + "; " + kForms);
  };
  if (s.empty()) refuse("empty");
  for (char ch : s)
    if (!((ch >= 'a' && ch <= 'z') || ch == ':' || ch == ','))
      refuse(std::string("the character '") + ch + "' is not allowed (lowercase names, ':' and ',' only)");
  Backends b;
  if (s.find(':') == std::string::npos) {
    if (s.find(',') != std::string::npos) refuse("a list needs device:backend pairs");
    const kt_comm_backend only = backend_of(s);
    if (only == KT_COMM_BACKEND_GLOO) b.cpu = only;
    else if (only == KT_COMM_BACKEND_NCCL) b.cuda = only;
    else refuse("'" + s + "' is not a backend (gloo or nccl)");
    return b;
  }
  for (const std::string& pair : split(s, ',')) {
    if (pair.empty()) refuse("an empty entry between commas");
    const std::vector<std::string> dv = split(pair, ':');
    if (dv.size() != 2) refuse("'" + pair + "' is not one device:backend pair");
    const std::string& device = dv[0];
    const std::string& name = dv[1];
    if (device.empty() || name.empty()) refuse("'" + pair + "' lacks its device or its backend");
    const kt_comm_backend backend = backend_of(name);
    if (backend == KT_COMM_BACKEND_NONE) refuse("'" + name + "' is not a backend (gloo or nccl)");
    if (device == "cpu") {
      if (b.cpu != KT_COMM_BACKEND_NONE) refuse("the device cpu is named twice");
      if (backend != KT_COMM_BACKEND_GLOO) refuse("cpu tensors take gloo (NCCL carries CUDA tensors only)");
      b.cpu = backend;
    } else if (device == "cuda") {
      if (b.cuda != KT_COMM_BACKEND_NONE) refuse("the device cuda is named twice");
      if (backend != KT_COMM_BACKEND_NCCL)
        refuse("cuda tensors take nccl (kt's Gloo carries CPU tensors only)");
      b.cuda = backend;
    } else {
      refuse("'" + device + "' is not a device (cpu or cuda)");
    }
  }
  return b;
}

}  // namespace kt::dist
