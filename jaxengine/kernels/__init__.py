"""Device side: Pallas kernels (installed as ``jaxengine.kernels``)."""
