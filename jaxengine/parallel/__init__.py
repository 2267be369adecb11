"""Scale-out: data-parallel replicas and several hosts. Tensor parallelism is layout, so its
device mesh lives with the model (``jaxengine.models.mesh``)."""
