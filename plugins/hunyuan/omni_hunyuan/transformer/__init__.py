"""HunyuanImage-3's model code: the decoder-only language model with its diffusion heads (patch embed, timestep
embedders, final layer), its attention over spans, 2-D RoPE, the token layout and the tensor-parallel plan."""
