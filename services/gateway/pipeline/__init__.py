"""The path every request takes, whatever its dialect: reading the body, the API key,
admission (slots, validation, tokenizing), sending to the schedulers, the reply stream back
(demultiplexing, detokenizing, stop strings), and running several generations at once."""
