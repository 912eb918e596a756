"""Flow control: paused queues and the rows that rate limits and key locks take
(SPEC "Flow control"). The claim route (``worker/claim.py``) applies the rules."""
