"""Integrations with the Hugging Face stack; each imports its library only when used."""
