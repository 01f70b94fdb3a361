// NUMA: the nodes of the CPUs an engine may use (Topology, discovered or
// given), and how an engine spreads over them (NumaLayout): its workers
// pinned per node, each expert owned by one node, whose workers compute it
// and on which its weights are asked to live. Passed to the engine; no
// globals.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace kt {

struct Topology {
  struct Node {
    int id = 0;             // the kernel's node number
    std::vector<int> cpus;  // ascending
  };
  std::vector<Node> nodes;  // nodes holding at least one CPU, ascending by id
  // Nodes described by the caller (tests), not the kernel's: memory is
  // never bound to them (placements are only recorded).
  bool simulated = false;
};

// Whether this build binds memory to nodes (libnuma). Without it an engine
// uses one node whatever its options.
bool numa_built();

// The kernel's nodes of `cpus` (libnuma); one node holding them all where
// the kernel reports none or the build has no libnuma.
Topology discover_topology(const std::vector<int>& cpus);

// Asks the kernel to keep the pages of [p, p + bytes) on node `node` (the
// kernel's number): preferred there, pages already elsewhere moved. Whole
// pages only (the range is rounded inward). False where nothing was asked
// (no libnuma, an empty range) or the kernel refused.
bool bind_to_node(void* p, size_t bytes, int node);

class NumaLayout {
 public:
  // One node of one worker: no groups, no binding.
  NumaLayout() = default;
  // `threads` workers over the topology's nodes in proportion to their
  // CPUs (each node used keeps one at least; with fewer threads than nodes,
  // the first nodes), worker i pinned to a CPU of its node. One node in
  // the topology (or one thread): one node of `threads` workers, not split.
  NumaLayout(const Topology& topology, int threads);

  int nodes() const { return static_cast<int>(node_workers_.size()); }
  bool split() const { return nodes() > 1; }
  // Per worker: its node (index into the used nodes) and CPU; empty when
  // not split.
  const std::vector<int>& worker_nodes() const { return worker_node_; }
  const std::vector<int>& worker_cpus() const { return worker_cpu_; }
  // Workers of node n (index), and its kernel number.
  int workers_on(int n) const { return node_workers_[static_cast<size_t>(n)]; }
  int node_id(int n) const { return node_id_[static_cast<size_t>(n)]; }
  const std::vector<int>& workers_per_node() const { return node_workers_; }
  // Expert ownership among E experts: node n owns [first_expert(n, E),
  // first_expert(n + 1, E)), in proportion to its workers.
  int64_t first_expert(int n, int64_t E) const;
  int expert_node(int64_t e, int64_t E) const;
  // Places experts [0, E) of a buffer of E blocks of expert_bytes each: the
  // pages of node n's experts on node n. Fills asked[e] with the node (index)
  // expert e was asked to live on, -1 everywhere when not split.
  void place_experts(void* data, int64_t E, int64_t expert_bytes, std::vector<int>* asked) const;

 private:
  std::vector<int> worker_node_, worker_cpu_;
  std::vector<int> node_workers_{1}, node_id_{0};
  bool simulated_ = false;
};

}  // namespace kt
