"""dspark: an LLM inference engine built around DSpark speculative decoding."""

from dspark.engine.llm_engine import LLMEngine, RequestOutput
from dspark.llm import LLM
from dspark.sampling_params import InvalidRequestError, SamplingParams

__all__ = ["LLM", "LLMEngine", "RequestOutput", "SamplingParams", "InvalidRequestError"]
__version__ = "0.1.0"
