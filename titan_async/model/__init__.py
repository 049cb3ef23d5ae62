"""The model: the `[model]` section and its presets, built into a torchtitan `ModelSpec`
(`llama`), the CPU attention (`attention`), seed-by-name initial weights (`init`), checks of
Hugging Face weights before a run starts from them (`hf_weights`), the whole model on the
meta device for planning and export (`meta`), and a checkpoint converted to a Hugging Face
Llama for export and benchmarks (`hf_conversion`).

A new model family goes here as one module beside `llama.py` (its presets and its spec
builder from torchtitan's model package), selected by the `[model]` section.
"""
