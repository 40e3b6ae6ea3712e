"""The tokenizer a Hub folder ships, as the run's tokenizer flags (--load-hf, tools/hf_checkpoint.py import).

A folder with any tokenizer file is the run's tokenizer (`--tokenizer-type HuggingFaceTokenizer --tokenizer-model
FOLDER`), checked readable now: a folder whose tokenizer_config.json is there but whose tokenizer file is not, or
whose tokenizer.json is not JSON, is refused naming the file, where it trained with the command line's (byte-level)
tokenizer before, or died later naming neither. A folder with no tokenizer file at all leaves the run's own.
"""

from __future__ import annotations

import os
from typing import Dict, Optional

from moezero.data.errors import DataError
from moezero.data.hub_tokenizer import FORMS, HuggingFaceTokenizer
from moezero.hf.files import CheckpointMismatch

# what shows a folder ships a tokenizer: its forms, and the files beside them that name one
SIGNS = FORMS + ("tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt")


def folder_tokenizer_fields(path: str) -> Optional[Dict[str, str]]:
    """{"tokenizer_type", "tokenizer_model"} of the folder's tokenizer, None where it ships none;
    CheckpointMismatch naming the file where it ships one that cannot be read."""
    present = [name for name in SIGNS if os.path.isfile(os.path.join(path, name))]
    if not present:
        return None
    if not any(name in FORMS for name in present):
        raise CheckpointMismatch(
            f"{path}: holds {', '.join(present)} but no tokenizer file ({', '.join(FORMS)}): "
            "copy the model's tokenizer in (the data must be tokenized with it)"
        )
    try:
        HuggingFaceTokenizer(path)
    except DataError as exc:  # "--tokenizer-model=PATH: <what is wrong with which file>"
        raise CheckpointMismatch(str(exc).split(": ", 1)[-1]) from None
    return {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": os.path.abspath(path)}
