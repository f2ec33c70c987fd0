"""Database adapters: the only part of RelStorage that contains SQL."""
