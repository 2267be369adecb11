"""Device side: Flax NNX models (installed as ``jaxengine.models``)."""
