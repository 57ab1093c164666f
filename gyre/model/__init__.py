"""Model directories by family (qwen2, llama, qwen3, qwen3_moe, qwen2_moe): config, weights with
checks, the HF <-> Megatron name maps, parameter counts, the model's own chat template and its
tool-call / reasoning parsers; a directory's identity, tokenizer and weights manifest; the tiny
model. Knows nothing of who serves or trains.

* ``families``: the supported families (and the refused hybrid ones), one table.
* ``spec``: ``config.json`` -> `ModelSpec`, safetensors checked against it.
* ``moe``: top-k routing shared by the engine's and trainer's forwards.
* ``megatron_names``: HF <-> Megatron-Core state-dict names per family, both directions.
* ``params``: total / active / expert parameter counts from a config.
* ``chat_template``, ``parsers``: the directory's Jinja chat template; tool-call and reasoning parsers.
* ``identity``, ``tokenizer``, ``checksums``: a directory's identity (tensor and tokenizer hashes),
  its tokenizer, and the weights manifest exporters write and engines verify.
* ``tiny``, ``build_tokenizer``, ``cli``: the offline tiny model of each family and Gyre's ChatML
  tokenizer (``gyre make-model``; ``cli`` is the one module that reads the configuration).
"""

# the package itself stays free of torch (identity, tokenizer and the command line need none):
# the weight readers are imported from gyre.model.spec
from gyre.model.families import FAMILIES, HYBRID, Family, ModelFormatError, family_of, supported

__all__ = ["FAMILIES", "HYBRID", "Family", "ModelFormatError", "family_of", "supported"]
