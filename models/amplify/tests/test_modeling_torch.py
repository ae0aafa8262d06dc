"""AMPLIFY's own checks of the pure-PyTorch backend (float32, CPU): hidden states against the reference, the padded
vocabulary. Logits, loss, gradients and packing against the reference are in the model contract
(test_model_contract.py)."""

import torch
from amplify_testing import make_batch, reference_to_nv
from transformers.modeling_outputs import BaseModelOutput

from amplify_te.modeling_amplify_te import NVAmplifyModel


TOLERANCE = 1e-4


def test_last_hidden_state_is_what_the_decoder_reads(reference_tiny):
    nv_model = reference_to_nv(reference_tiny, backend="torch").eval()
    batch = make_batch([21, 9])
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        expected = reference_tiny(**batch).last_hidden_state
        outputs = nv_model(**batch, output_hidden_states=True)
        encoder: BaseModelOutput = nv_model.amplify(batch["input_ids"], attention_mask=batch["attention_mask"])
    assert isinstance(nv_model.amplify, NVAmplifyModel)
    assert (encoder.last_hidden_state[real] - expected[real]).abs().max() <= TOLERANCE
    # One entry per layer input plus the final (normed) state, in the caller's layout.
    assert len(outputs.hidden_states) == reference_tiny.config.num_hidden_layers + 1
    assert torch.equal(outputs.hidden_states[-1], encoder.last_hidden_state)


def test_padded_vocabulary_never_reaches_outputs(reference_tiny):
    nv_model = reference_to_nv(reference_tiny, backend="torch")
    assert nv_model.config.padded_vocab_size == 64
    assert nv_model.amplify.embeddings.weight.shape[0] == 64 and nv_model.decoder.weight.shape[0] == 64
    batch = make_batch([10])
    out = nv_model(**batch)
    assert out.logits.shape[-1] == 27
    out.loss.backward()
    # The padded decoder rows get no gradient: no logit ever came from them.
    assert torch.count_nonzero(nv_model.decoder.weight.grad[27:]) == 0
    assert torch.count_nonzero(nv_model.decoder.bias.grad[27:]) == 0
