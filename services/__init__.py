"""Thin asyncio shells over the library: consume -> fold -> decide -> append."""
