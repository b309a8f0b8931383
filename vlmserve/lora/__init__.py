"""LoRA adapters in PEFT's format: what a request names (`LoRARequest`) and how an
adapter folder is read and checked against the layers a model can adapt."""
