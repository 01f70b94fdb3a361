#include "runtime/numa.h"

#include <unistd.h>

#include <algorithm>
#include <map>

#if KT_HAVE_NUMA
#include <numa.h>
#include <numaif.h>
#endif

namespace kt {

#if KT_HAVE_NUMA
bool numa_built() { return true; }

Topology discover_topology(const std::vector<int>& cpus) {
  Topology t;
  std::map<int, std::vector<int>> by_node;
  const bool known = numa_available() >= 0;
  for (int c : cpus) {
    const int node = known ? numa_node_of_cpu(c) : 0;
    by_node[node < 0 ? 0 : node].push_back(c);
  }
  for (auto& n : by_node) t.nodes.push_back({n.first, n.second});
  return t;
}

bool bind_to_node(void* p, size_t bytes, int node) {
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(p) + page - 1) / page * page;
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + bytes) / page * page;
  if (end <= begin || node < 0) return false;
  std::vector<unsigned long> mask(static_cast<size_t>(node) / (8 * sizeof(unsigned long)) + 1, 0);
  mask[static_cast<size_t>(node) / (8 * sizeof(unsigned long))] |= 1ul << (node % (8 * sizeof(unsigned long)));
  // maxnode counts the mask's bits plus one (the kernel reads maxnode - 1).
  return mbind(reinterpret_cast<void*>(begin), end - begin, MPOL_PREFERRED, mask.data(),
               mask.size() * 8 * sizeof(unsigned long) + 1, MPOL_MF_MOVE) == 0;
}
#else
bool numa_built() { return false; }

Topology discover_topology(const std::vector<int>& cpus) {
  Topology t;
  t.nodes.push_back({0, cpus});
  return t;
}

bool bind_to_node(void*, size_t, int) { return false; }
#endif

NumaLayout::NumaLayout(const Topology& topology, int threads) {
  const int64_t nodes = static_cast<int64_t>(topology.nodes.size());
  if (nodes < 2 || threads < 2) {
    node_workers_ = {std::max(threads, 1)};
    node_id_ = {topology.nodes.empty() ? 0 : topology.nodes[0].id};
    return;
  }
  // Workers per node in proportion to its CPUs (one at least, while
  // threads last: the first nodes).
  const int64_t used = std::min<int64_t>(nodes, threads);
  int64_t cpus = 0;
  for (int64_t n = 0; n < used; ++n) cpus += static_cast<int64_t>(topology.nodes[static_cast<size_t>(n)].cpus.size());
  std::vector<int> share(static_cast<size_t>(used), 1);
  const int64_t left = threads - used;
  for (int64_t n = 0, given = 0, below = 0; n < used; ++n) {
    below += static_cast<int64_t>(topology.nodes[static_cast<size_t>(n)].cpus.size());
    const int64_t upto = n + 1 == used ? left : left * below / cpus;
    share[static_cast<size_t>(n)] += static_cast<int>(upto - given);
    given = upto;
  }
  node_workers_.clear();
  node_id_.clear();
  for (int64_t n = 0; n < used; ++n) {
    const Topology::Node& node = topology.nodes[static_cast<size_t>(n)];
    node_workers_.push_back(share[static_cast<size_t>(n)]);
    node_id_.push_back(node.id);
    for (int w = 0; w < share[static_cast<size_t>(n)]; ++w) {
      worker_node_.push_back(static_cast<int>(n));
      worker_cpu_.push_back(node.cpus[static_cast<size_t>(w) % node.cpus.size()]);
    }
  }
  simulated_ = topology.simulated;
}

int64_t NumaLayout::first_expert(int n, int64_t E) const {
  int64_t before = 0, all = 0;
  for (int k = 0; k < nodes(); ++k) {
    if (k < n) before += node_workers_[static_cast<size_t>(k)];
    all += node_workers_[static_cast<size_t>(k)];
  }
  return E * before / all;
}

int NumaLayout::expert_node(int64_t e, int64_t E) const {
  int n = 0;
  while (n + 1 < nodes() && first_expert(n + 1, E) <= e) ++n;
  return n;
}

void NumaLayout::place_experts(void* data, int64_t E, int64_t expert_bytes, std::vector<int>* asked) const {
  asked->assign(static_cast<size_t>(E), -1);
  if (!split() || !data) return;
  for (int n = 0; n < nodes(); ++n) {
    const int64_t e0 = first_expert(n, E), e1 = first_expert(n + 1, E);
    if (e1 <= e0) continue;
    for (int64_t e = e0; e < e1; ++e) (*asked)[static_cast<size_t>(e)] = n;
    if (!simulated_)
      bind_to_node(static_cast<char*>(data) + e0 * expert_bytes, static_cast<size_t>((e1 - e0) * expert_bytes),
                   node_id(n));
  }
}

}  // namespace kt
