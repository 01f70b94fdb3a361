#include <oneapi/dnnl/dnnl.hpp>

int main() {
  dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  dnnl::memory::desc desc({1, 16}, dnnl::memory::data_type::f32, dnnl::memory::format_tag::ab);
  return desc.get_size() == 64 ? 0 : 1;
}
