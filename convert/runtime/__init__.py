"""Runtime side: the host contract's driver, parts chained as one target, speculative decoding and its economics."""
