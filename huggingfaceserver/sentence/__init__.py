"""A model folder as sentence-transformers reads it, and what its modules do to a model's output.

:mod:`.config` reads every published layout (2.x to 6.x) as JSON, with neither torch nor
sentence-transformers (every process reads it: the fronts for prompts and lengths, the engine for
the modules); :mod:`.head` runs the modules after the transformer (pooling, dense layers, layer
norm, normalisation, SPLADE) in torch, where the model runs.
"""
