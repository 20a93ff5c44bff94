"""Model names a server answers to: the ids it serves and the names DeepSeek's API uses.

The served ids are `--served-model-name` (vLLM's flag; the first is reported in responses) or
the checkpoint's canonical name (engine.runtime.engine.canonical_model_id). A request may also
name the family as DeepSeek's API does: `deepseek-chat` (thinking off unless asked for),
`deepseek-reasoner` (thinking on unless the request says otherwise), `deepseek-v4-flash`,
`deepseek-v4.1-flash`; and the checkpoint directory's name, which earlier versions served.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .protocol import APIError

__all__ = ["FAMILY_NAMES", "ModelNames", "thinking_default"]

FAMILY_NAMES = ("deepseek-v4-flash", "deepseek-v4.1-flash", "deepseek-chat", "deepseek-reasoner")
_THINKING_BY_NAME = {"deepseek-reasoner": True, "deepseek-chat": False}
_ECHO_MAX = 64  # characters of an unknown name repeated in the error


@dataclass(frozen=True)
class ModelNames:
    served: tuple[str, ...]  # /v1/models lists these; responses report served[0]
    aliases: frozenset[str]  # accepted as well, never listed

    @classmethod
    def make(cls, model_id: str, ckpt_name: str | None = None, served: Iterable[str] = ()) -> ModelNames:
        ids = tuple(dict.fromkeys(s for s in served if s)) or (model_id,)
        extra = {model_id, *FAMILY_NAMES} | ({ckpt_name} if ckpt_name else set())
        return cls(ids, frozenset(extra - set(ids)))

    def accepts(self, name: str) -> bool:
        return name in self.served or name in self.aliases

    def resolve(self, name: str) -> str:
        """The id to report for a request naming `name`; 404 model_not_found if unknown."""
        if not self.accepts(name):
            raise not_found(name, self.served)
        return self.served[0]


def not_found(name: str, served: tuple[str, ...]) -> APIError:
    shown = name if len(name) <= _ECHO_MAX else name[:_ECHO_MAX] + "..."
    return APIError(404, f"The model {shown!r} does not exist; this server serves {', '.join(served)}",
                    param="model", code="model_not_found")


def thinking_default(name: str | None, body: Any) -> bool | None:
    """The thinking mode a family name implies when the request does not choose one, else None."""
    want = _THINKING_BY_NAME.get(name or "")
    if want is None or not isinstance(body, dict):
        return None
    if body.get("thinking") is not None or body.get("reasoning_effort") is not None:
        return None
    ctk = body.get("chat_template_kwargs")
    if isinstance(ctk, dict) and ("thinking" in ctk or "enable_thinking" in ctk):
        return None
    return want
