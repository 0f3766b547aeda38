"""Adapters on a frozen base model: LoRA's values and maths (lora), the files users already
have read into mdi's naming (adapter_files, peft_targets), and training them through the ring:
a LoRA's trainable parameters (lora_train), one node's share of a step (stage_train) and the
soft prompt of prompt tuning (prompt_train).
"""
