"""omnicore example plugin: PixArt-Sigma through diffusers (see docs/writing-a-model-plugin.md)."""
