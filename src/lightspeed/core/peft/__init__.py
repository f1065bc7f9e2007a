"""PEFT (LoRA and other adapters) under ZeRO: finding the adapters in a model, and their export layout."""
