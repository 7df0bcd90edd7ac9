"""The model: inventory, families and layer structure, the small-model cut and its checks, generated weights,
vLLM loading."""
