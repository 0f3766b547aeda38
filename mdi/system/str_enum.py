"""A vocabulary of strings as an Enum (enum.StrEnum arrived only in Python 3.11): each member
is its string wherever it goes (==, dict keys, JSON, msgpack, "%s" and f-strings), so the bytes
on the wire and in files stay what they were, while code names the members."""
from enum import Enum


class StrEnum(str, Enum):
    def __str__(self) -> str:
        return str.__str__(self)

    def __format__(self, spec: str) -> str:
        return str.__format__(str(self), spec)
