"""The PyTorch runtime (transformers models on torch), in one place: the encoder runner
(:mod:`.encoder`, which ONNX Runtime's encoder extends), CPU thread calibration (:mod:`.threads`),
and the generation backend (:mod:`.generator`) with its decode core: the continuously batched
decode loop (:mod:`.decode_loop`), the model side of a batch (:mod:`.decode_batch`) over the KV
cache reserved ahead (:mod:`.kv_cache`), and the token choice (:mod:`.sequence`, :mod:`.sampling`
with :mod:`.logits`, :mod:`.penalties` and the grammar masks of :mod:`.masks`).

The decode core is driven alike in-process (:meth:`.generator.TransformersGenerator.generate`)
and from the engine process (:mod:`...topology.engine.process`): both submit a
:class:`.decode_loop.DecodeRequest` of rows and an ``emit`` callback to the one
:class:`.decode_loop.ContinuousBatcher`.
"""
