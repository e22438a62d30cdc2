"""omnicore plugin for MiniMax-H3 (joint video + audio generation: t2va, fl2va, ref2va)."""
