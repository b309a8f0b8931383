"""Speculative decoding: proposers of draft tokens (the target model verifies them in
`worker.rejection_sampler`)."""
