"""The objective room: what training scores. `anchors` (where blocks start, drawn per sample),
`blocks` (Blocks: a micro-batch's block inputs, labels, validity and weights, built once), `loss`
(BlockLoss: the chunked lm_head pass, the cross-entropy and the acceptance metrics; LogitTerm),
`terms` (the terms of --loss: D-PACE, KL, LK, with their options)."""
