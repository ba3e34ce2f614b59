"""models: stage-splittable LLaMA-style model, byte tokenizer, corpora, HF adapter.

Pure torch; never imports network or comm code (no grpc, no hivemind). transformers is only
imported when a Hugging Face checkpoint is actually loaded (models/hf_adapter.py).
"""

from models.config import DataConfig, ModelConfig
from models.corpus import Corpus, batches, eval_batches, evaluate, load_corpus
from models.hf_adapter import HFCausalLM, build_from_config, load_hf_causal_lm
from models.llama import Llama, build_model, lm_loss
from models.tokenizer import ByteTokenizer

__all__ = [
    "ByteTokenizer", "Corpus", "DataConfig", "HFCausalLM", "Llama", "ModelConfig", "batches",
    "build_from_config", "build_model", "eval_batches", "evaluate", "lm_loss", "load_corpus",
    "load_hf_causal_lm",
]
