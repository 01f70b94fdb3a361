# The optimizer (src/optim); its per-element loops are per-ISA units of the
# kernels (src/kernels/sources.cmake, update_<isa>.cpp).
list(APPEND KT_CORE_SOURCES
  src/optim/optimizer.cpp
  src/optim/step_job.cpp
)
