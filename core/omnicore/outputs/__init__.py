"""Generation outputs and their writers (PNG/WebP through Pillow, MP4 with AAC audio through PyAV)."""
