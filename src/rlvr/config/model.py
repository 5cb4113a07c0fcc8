"""Settings of the model and its data: what is trained (model, dtype, LoRA) and on which prompts."""

from __future__ import annotations

from dataclasses import dataclass, field

from rlvr.config.section import Section, choices


@dataclass(frozen=True)
class ModelSettings(Section):
    # --- model ----------------------------------------------------------------------
    model: str = "default"  # "default" (embedded SmolLM2-135M-Instruct), a local dir, a run dir, or a hub id
    dtype: str = "float32"  # weights: float32 | bfloat16
    use_cpu: bool = False  # stay on the CPU even where a CUDA GPU is visible (else cuda:LOCAL_RANK)
    model_init_kwargs: dict = field(default_factory=dict)  # keyword arguments for from_pretrained, e.g. {attn_implementation: sdpa, revision: main}
    trust_remote_code: bool = False  # run the model repository's own code (a hub model with custom modelling files)

    # --- lora -----------------------------------------------------------------------
    use_peft: bool = False  # train a LoRA adapter (peft) instead of every weight
    lora_r: int = 16  # adapter rank
    lora_alpha: int = 32  # adapter scale alpha / r (alpha / sqrt(r) with use_rslora)
    lora_dropout: float = 0.05  # dropout on the adapter input; off with every other dropout while disable_dropout=true (the default)
    lora_target_modules: tuple | None = None  # module names to adapt; default: peft's choice for the architecture (Llama: q_proj, v_proj), as TRL; all-linear: every linear layer of attention and MLP
    lora_target_parameters: tuple | None = None  # parameter names to adapt (peft's target_parameters, e.g. MoE experts' weights)
    lora_modules_to_save: tuple | None = None  # modules trained whole beside the adapter, e.g. [lm_head]
    lora_task_type: str = "CAUSAL_LM"  # peft's task type
    use_rslora: bool = False  # rank-stabilised LoRA: scale alpha / sqrt(r)
    use_dora: bool = False  # DoRA: weight-decomposed LoRA (a magnitude per output besides the low-rank update)
    lora_config: dict | None = None  # a peft LoraConfig with every option, as given to GRPOTrainer(peft_config=...) (its to_dict()); used instead of the lora_* settings above
    lora_save: str = "adapter"  # final save: adapter (peft format) | merged (a plain model)

    # --- qlora ----------------------------------------------------------------------
    load_in_4bit: bool = False  # QLoRA: the model's linear layers loaded in 4 bits (bitsandbytes), frozen under the LoRA adapter (needs use_peft)
    bnb_4bit_quant_type: str = "nf4"  # load_in_4bit: nf4 (4-bit NormalFloat, QLoRA's) | fp4
    use_bnb_nested_quant: bool = False  # load_in_4bit: quantize the quantization constants too (double quantization, about 0.4 bits a weight less)
    bnb_4bit_quant_storage: str | None = None  # load_in_4bit: the dtype the packed 4-bit weights are stored in: uint8 | float16 | bfloat16 | float32; null: uint8

    def _rules(self) -> list[str]:
        problems = choices(self, dtype=("float32", "bfloat16"), lora_save=("adapter", "merged"), bnb_4bit_quant_type=("nf4", "fp4"))
        if self.bnb_4bit_quant_storage not in (None, "uint8", "float16", "bfloat16", "float32"):
            problems.append(f"bnb_4bit_quant_storage must be uint8, float16, bfloat16 or float32 (or null: uint8); "
                            f"got {self.bnb_4bit_quant_storage!r}")
        if not (self.lora_r >= 1 and self.lora_alpha > 0):
            problems.append("lora_r must be at least 1 and lora_alpha > 0")
        if not 0 <= self.lora_dropout < 1:
            problems.append("lora_dropout must be in [0, 1)")
        for key in ("dtype", "torch_dtype"):
            value = self.model_init_kwargs.get(key, self.dtype)
            if value != self.dtype:
                problems.append(
                    f"model_init_kwargs.{key}={value!r} differs from dtype={self.dtype!r}: the weights' dtype is "
                    f"rlvr's own dtype setting (float32 or bfloat16; vLLM and `rlvr plan` read it too), so set dtype there and "
                    f"drop {key} from model_init_kwargs")
        return problems + self._qlora_problems()

    def _qlora_problems(self) -> list[str]:
        if not self.load_in_4bit:
            return []
        rules = [
            (self.use_peft, "load_in_4bit=true (QLoRA) trains a LoRA adapter over the frozen 4-bit weights, which cannot be "
                            "trained themselves: set use_peft=true"),
            (self.lora_save != "merged", "lora_save=merged with load_in_4bit would merge the adapter into rounded 4-bit weights: "
                                         "keep lora_save=adapter (rlvr eval puts it on the full-precision base model)"),
            ("quantization_config" not in self.model_init_kwargs,
             "load_in_4bit sets the model's quantization_config: drop quantization_config from model_init_kwargs"),
        ]
        return [message for ok, message in rules if not ok]


@dataclass(frozen=True)
class DataSettings(Section):
    # --- data -----------------------------------------------------------------------
    task: str = "arithmetic"  # a built-in task: arithmetic, countdown, reasoning_gym, humaneval; or gsm8k, math500, aime, which read `dataset` (default: from the hub). Unset, `dataset` is a plain dataset
    task_args: dict = field(default_factory=dict)  # the task's own knobs, e.g. {digits: 2, operands: 3}
    dataset: str | None = None  # hub id, or a local .jsonl / .json / .parquet / .csv file
    dataset_config: str | None = None  # the dataset's configuration (subset) name
    dataset_train_split: str = "train"  # the split to train on
    dataset_test_split: str = "test"  # held out from train when the dataset has no such split
    prompt_column: str | None = None  # default: the first of prompt, question, problem
    answer_column: str | None = None  # default: the first of answer, solution, ground_truth
    system_prompt: str | None = None  # text, or "r1" for the built-in think/answer prompt
    text_prompts: str = "chat"  # a plain-text prompt: chat = one user message of the chat template | raw = the text as it is (TRL's; GRPOTrainer's default)
    max_prompt_length: int | None = None  # cut longer prompts from the left to this many tokens; null: never cut (as TRL), a prompt longer than the model's context is refused
    shuffle_dataset: bool = True  # draw the train prompts in a new random order each epoch; false: in file order
    chat_template_kwargs: dict = field(default_factory=dict)  # extra arguments for the chat template, e.g. {enable_thinking: false} (Qwen3)

    def _rules(self) -> list[str]:
        problems = choices(self, text_prompts=("chat", "raw"))
        if self.max_prompt_length is not None and not (isinstance(self.max_prompt_length, int) and self.max_prompt_length >= 1):
            problems.append(f"max_prompt_length must be a number of tokens >= 1, or null for no limit (got {self.max_prompt_length!r})")
        reserved = sorted({"add_generation_prompt", "tokenize", "conversation"} & set(self.chat_template_kwargs))
        if reserved:
            problems.append(f"chat_template_kwargs cannot set {', '.join(reserved)}: rlvr sets it when it renders a prompt")
        if self.text_prompts == "raw" and self.system_prompt:
            problems.append("system_prompt needs text_prompts=chat: a raw text prompt has no "
                            "system message to put it in (put the instruction in the prompt text instead)")
        return problems
