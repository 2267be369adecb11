"""Scale-out: tensor parallelism over a device mesh, data-parallel replicas, several hosts."""
