"""Loading models and what is put on them: vision parts, inference, sequence parallel, tiled MLP."""
