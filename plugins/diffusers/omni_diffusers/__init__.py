"""omnicore adapter serving stock diffusers pipelines (``DiffusionPipeline`` checkpoints) through every surface."""
