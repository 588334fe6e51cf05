"""File formats: a streaming safetensors writer and a ranged reader."""
