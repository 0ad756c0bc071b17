"""The shared home of chat families (``ChatFamily``): chat records and their readers (LLaVA JSON,
ms-swift JSONL: ``records``), the encoder with the template logic and end-of-turn ids
(``encoder``), datasets, packing and the collate (``dataset``), attention-mask kinds (``masks``),
the next-token loss (``loss``), ``mmpipe data check`` for chat data (``check``) and generation with
a KV cache (``generate``). The VLM (``families/vlm``) and any later chat family use it without
importing one another."""
from mmpipe.families.chat.dataset import ChatCollate, ChatDataset, PackedChatDataset, plan_packs
from mmpipe.families.chat.encoder import ChatEncoder, Encoded, add_chat_tokens, chat_special_tokens
from mmpipe.families.chat.records import (
    IMAGE,
    ROLE_TOKENS,
    SPECIAL_TOKENS,
    ChatSample,
    chat_texts,
    read_chat,
    read_llava_json,
    read_swift_jsonl,
)

__all__ = ["IMAGE", "ROLE_TOKENS", "SPECIAL_TOKENS", "ChatCollate", "ChatDataset", "ChatEncoder", "ChatSample", "Encoded",
           "PackedChatDataset", "add_chat_tokens", "chat_special_tokens", "chat_texts", "plan_packs", "read_chat",
           "read_llava_json", "read_swift_jsonl"]
