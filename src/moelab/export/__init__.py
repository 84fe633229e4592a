"""Hugging Face export (`hf`: a Qwen3-MoE checkpoint) and KV-cache generation (`generate`)."""
