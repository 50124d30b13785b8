"""The shared core every part imports: the KV-event codec, block keys, the tokenizer and
chat templates, and the block index (in process or in Redis).
"""
