"""Dataset reading, row parsing, tokenisation with loss masks, and the pre-scan.

A row's path: ``iter_rows`` -> ``parse_row`` (+ ``sample_id_of``) -> ``ChatTokenizer.tokenize``
-> ``check_loss_mask``. ``scan_dataset`` runs once before planning.
"""

from layertap.data.chat import ChatTokenizer, check_loss_mask
from layertap.data.reader import iter_rows
from layertap.data.rows import Conversation, ParsedRow, Preformatted, Pretokenized, parse_row, sample_id_of
from layertap.data.scan import DatasetScan, scan_dataset

__all__ = [
    "ChatTokenizer",
    "Conversation",
    "DatasetScan",
    "ParsedRow",
    "Preformatted",
    "Pretokenized",
    "check_loss_mask",
    "iter_rows",
    "parse_row",
    "sample_id_of",
    "scan_dataset",
]
