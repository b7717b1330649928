"""Tiny, fully offline models for fast tests: a BPE tokenizer trained on a few sentences and a
random 2-layer Llama. Built once per session under a temporary directory."""

from __future__ import annotations

from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    # A template variable, as Qwen3's enable_thinking: chat_template_kwargs must reach it.
    "{% if enable_thinking is defined and enable_thinking %}<think>\n{% endif %}"
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France? Paris is the capital of France.",
    "Write a haiku about the sea, the waves and the wind.",
    "Explain gravity: masses attract each other with a force.",
    "def add(a, b):\n    return a + b\n",
    "SELECT name FROM users WHERE id = 1;",
    "Hello there! How can I help you today?",
    "Numbers 0 1 2 3 4 5 6 7 8 9 and symbols + - * / = ( ) [ ] { } : ; , . ! ?",
    "Unicode: café naïve résumé 東京 😀",
]


def build_tiny_model(
    out: Path, *, seed: int = 0, vocab_size: int = 384, layers: int = 2, hidden: int = 64
) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=0.2,  # peaky logits: greedy ties between batched and single runs stay rare
        eos_token_id=fast.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=fast.pad_token_id,
        bos_token_id=None,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(out, safe_serialization=True)
    return out


def tiny_policy_yaml(model_dir: Path, **overrides: object) -> str:
    """The default policy's shape over the tiny model (int4 / int8 / fp32, drafts below)."""
    cache = overrides.pop("cache_enabled", True)
    seqs = overrides.pop("max_num_seqs", 8)
    queue = overrides.pop("max_queue", 16)
    extra_service = overrides.pop("service_extra", "")
    auth = overrides.pop("auth", "{mode: open}")
    return f"""
version: 1
tiers:
  small:
    model: {model_dir}
    quantization: int4
    max_num_seqs: {seqs}
    max_queue: {queue}
    max_model_len: 256
    draft: null
    defaults: {{max_tokens: 16, temperature: 0}}
  medium:
    model: {model_dir}
    quantization: int8
    max_num_seqs: {seqs}
    max_queue: {queue}
    max_model_len: 256
    draft: small
    speculative_tokens: 3
    defaults: {{max_tokens: 16, temperature: 0}}
  large:
    model: {model_dir}
    max_num_seqs: {seqs}
    max_queue: {queue}
    max_model_len: 256
    draft: medium
    speculative_tokens: 3
    defaults: {{max_tokens: 16, temperature: 0}}
routing:
  aliases: {{fast: small}}
  rules:
    - name: priority-header
      when: {{headers: {{x-priority: high}}}}
      tier: large
    - name: score-small
      when: {{score_below: 0.35}}
      tier: small
    - name: score-medium
      when: {{score_below: 0.65}}
      tier: medium
    - name: score-large
      tier: large
  fallback: {{small: medium, medium: large, large: null}}
service:
  queue_timeout_s: 20
  drain_timeout_s: 5
  auth: {auth}
  cache:
    enabled: {str(cache).lower()}
{extra_service}
"""


def make_engine(
    worker: object,
    model_dir: Path,
    *,
    quantization: str = "none",
    draft_quantization: str | None = None,
    draft_dir: Path | None = None,
    speculative_tokens: int = 3,
    ngram: bool = False,
    max_num_seqs: int = 16,
    max_model_len: int = 256,
    max_num_batched_tokens: int = 128,
    max_waiting: int = 64,
    kv_tokens: int = 8192,
    block_size: int = 4,
    prefix_caching: bool = False,
    fast_path: bool = True,
    name: str = "test",
) -> object:
    """An engine over the tiny model, built and attached on ``worker`` (a DeviceWorker).

    ``draft_quantization`` (or ``draft_dir``, another tiny model) gives it a draft runner with
    its own pool, as a tier below would have; ``ngram`` drafts by n-gram lookup instead."""
    from tiers.core.sched.scheduler import SchedulerConfig
    from tiers.engine.llm_engine import Engine
    from tiers.models.loading import load_model
    from tiers.spec_decode.ngram import NgramProposer
    from tiers.worker.device import DeviceWorker
    from tiers.worker.model_runner import ModelRunner

    assert isinstance(worker, DeviceWorker)

    def runner_for(path: Path, quant: str) -> ModelRunner:
        loaded = load_model(str(path), device="cpu", quantization=quant)  # type: ignore[arg-type]
        return ModelRunner(
            loaded,
            num_blocks=kv_tokens // block_size,
            block_size=block_size,
            max_model_len=max_model_len,
            enable_prefix_caching=prefix_caching,
            fast_path=fast_path,
        )

    def build() -> Engine:
        runner = runner_for(model_dir, quantization)
        draft: ModelRunner | NgramProposer | None = None
        if ngram:
            draft = NgramProposer(2 * runner.blocks.num_blocks, block_size)
        elif draft_quantization is not None or draft_dir is not None:
            draft = runner_for(draft_dir or model_dir, draft_quantization or "none")
        engine = Engine(
            name,
            runner,
            SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_model_len=max_model_len,
                max_num_batched_tokens=max_num_batched_tokens,
                max_waiting=max_waiting,
            ),
            draft_runner=draft,
            speculative_tokens=speculative_tokens if draft is not None else 0,
        )
        engine.warmup()
        return engine

    engine = worker.call(build)
    engine.attach(worker)
    return engine
