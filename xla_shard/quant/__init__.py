"""Frozen base weights stored in 4 bits (QLoRA), in bitsandbytes' format (`bnb4`)."""
