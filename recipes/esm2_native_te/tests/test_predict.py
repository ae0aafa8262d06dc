"""predict.py: embeddings and pseudo-log-likelihoods equal a one-sequence-at-a-time computation, for ESM-2 and AMPLIFY
exports, in one process and split over two; input rows, ids and policies; and the errors a user can make."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hf_export import write_hf_directory
from launch import run_in_process, run_script
from modeling_amplify_te import NVAmplifyConfig, NVAmplifyForMaskedLM
from modeling_esm_te import NVEsmConfig, NVEsmForMaskedLM, NVEsmForTokenClassification
from test_amplify import published_checkpoint, tiny_config  # noqa: F401 (a fixture, used by name)
from transformers import AutoTokenizer


SEQUENCES = ["MKTAYIAKQR", "GSHMLEDPVA" * 4, "ACDEFGHIKLMNPQRSTVWY", "MVLSPADKTNVKAAW" * 3, "KK"]
FAMILIES = {
    "esm2": (NVEsmConfig, NVEsmForMaskedLM, "model_configs/esm2_t6_8M_UR50D", "tokenizer"),
    "amplify": (NVAmplifyConfig, NVAmplifyForMaskedLM, "model_configs/AMPLIFY_120M", "tokenizer_amplify"),
}


def make_export(directory, family: str = "esm2", model_class=None):
    """A small random model of ``family`` (2 layers, torch backend), exported as training exports it."""
    config_class, masked_lm_class, config_dir, tokenizer_dir = FAMILIES[family]
    torch.manual_seed(0)
    config = config_class.from_pretrained(config_dir, num_hidden_layers=2, backend="torch")
    if family == "amplify":
        config.hidden_size, config.num_attention_heads, config.intermediate_size = 64, 4, 128
    model = (model_class or masked_lm_class)(config)
    write_hf_directory(model, directory, tokenizer=AutoTokenizer.from_pretrained(tokenizer_dir))
    return masked_lm_class.from_pretrained(directory, backend="torch", dtype=torch.float32).eval()


def write_sequences(path, sequences, ids=None):
    columns = {"sequence": sequences} if ids is None else {"id": ids, "sequence": sequences}
    pq.write_table(pa.table(columns), path)
    return path


def one_at_a_time(model, encoder, tokenizer, sequence: str) -> tuple[np.ndarray, float]:
    """The reference: the model's BSHD forward on one sequence; its mean residue state; its PLL, one mask per pass."""
    ids = torch.tensor(tokenizer(sequence)["input_ids"])
    with torch.no_grad():
        hidden = encoder(input_ids=ids[None]).last_hidden_state[0]
        pll = 0.0
        for position in range(1, len(ids) - 1):
            masked = ids.clone()
            masked[position] = tokenizer.mask_token_id
            logits = model(input_ids=masked[None]).logits[0, position]
            pll += torch.log_softmax(logits.double(), dim=-1)[ids[position]].item()
    return hidden[1:-1].mean(0).numpy(), pll


def assert_predictions_are_one_at_a_time(out_dir, sequences, model, encoder, tokenizer) -> dict:
    """``out_dir``'s embeddings and PLLs equal :func:`one_at_a_time` of ``model`` row by row; returns the table."""
    table = pq.read_table(out_dir / "predictions.parquet").to_pydict()
    embeddings = np.load(out_dir / "embeddings.npy")
    assert embeddings.dtype == np.float32 and embeddings.shape == (len(sequences), model.config.hidden_size)
    for row, sequence in enumerate(sequences):
        embedding, pll = one_at_a_time(model.eval(), encoder, tokenizer, sequence)
        np.testing.assert_allclose(embeddings[row], embedding, atol=2e-5, rtol=1e-4)
        assert table["pll"][row] == pytest.approx(pll, abs=1e-3, rel=1e-5)
        assert table["mean_log_likelihood"][row] == pytest.approx(pll / len(sequence), abs=1e-4)
    return table


@pytest.mark.parametrize("family", ["esm2", "amplify"])
def test_predictions_equal_one_sequence_at_a_time_in_input_order(tmp_path, family):
    model = make_export(tmp_path / "export", family)
    data = write_sequences(tmp_path / "seqs.parquet", SEQUENCES, ids=[f"p{i}" for i in range(len(SEQUENCES))])
    # Budgets of 64 tokens: several sequences share a pass, the 47-token one gets its own, PLL copies span passes.
    run_script(
        "predict.py", f"model_path={tmp_path / 'export'}", f"data.path={data}", f"output_dir={tmp_path / 'out'}",
        "token_budget=64", "pll_token_budget=64", "data.max_seq_length=64",
    )  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "export")
    encoder = model.esm if family == "esm2" else model.amplify
    table = assert_predictions_are_one_at_a_time(tmp_path / "out", SEQUENCES, model, encoder, tokenizer)
    assert table["index"] == list(range(len(SEQUENCES))) and table["id"] == [f"p{i}" for i in range(len(SEQUENCES))]
    assert table["num_residues"] == [len(s) for s in SEQUENCES]
    assert not list((tmp_path / "out").glob("*.rank*")) and not list((tmp_path / "out").glob(".*partial"))


def test_two_processes_write_what_one_does(tmp_path):
    make_export(tmp_path / "export")
    data = write_sequences(tmp_path / "seqs.parquet", SEQUENCES)
    common = [f"model_path={tmp_path / 'export'}", f"data.path={data}", "data.max_seq_length=64", "token_budget=64"]
    run_script("predict.py", *common, f"output_dir={tmp_path / 'one'}")
    run_script("predict.py", *common, f"output_dir={tmp_path / 'two'}", nproc=2)
    one, two = (pq.read_table(tmp_path / name / "predictions.parquet").to_pydict() for name in ("one", "two"))
    assert two["index"] == one["index"] == list(range(len(SEQUENCES)))
    assert two["id"] == [str(i) for i in range(len(SEQUENCES))]  # no id column: the row numbers
    np.testing.assert_allclose(two["pll"], one["pll"], rtol=1e-6)
    np.testing.assert_allclose(
        np.load(tmp_path / "two" / "embeddings.npy"), np.load(tmp_path / "one" / "embeddings.npy"), atol=1e-6
    )


def test_fasta_headers_are_the_ids_and_skipped_rows_keep_their_input_index(tmp_path):
    make_export(tmp_path / "export")
    fasta = tmp_path / "seqs.fasta"
    fasta.write_text(">first some description\nMKTAYIAKQR\n>bad\nMKJJ\n>long\n" + "A" * 70 + "\n>last\nGSHMLE\n")
    run_script(
        "predict.py", f"model_path={tmp_path / 'export'}", f"data.path={fasta}", f"output_dir={tmp_path / 'out'}",
        "data.invalid_residue_policy=skip", "data.long_sequence_policy=skip", "data.max_seq_length=64",
        "token_budget=64", "pll=false",
    )  # fmt: skip
    table = pq.read_table(tmp_path / "out" / "predictions.parquet").to_pydict()
    assert table == {"index": [0, 3], "id": ["first", "last"], "num_residues": [10, 6]}  # no PLL columns
    assert np.load(tmp_path / "out" / "embeddings.npy").shape == (2, 320)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["data.id_column=name"], "no column 'name'; columns are ['id', 'sequence']: set data.id_column"),
        (["data.sequence_column=seq"], "no column 'seq'; columns are ['id', 'sequence']: set data.sequence_column"),
        (["token_budget=100"], "token_budget=100 is below data.max_seq_length=1024"),
        (["dtype=float16"], "dtype=float16: choose auto, float32 or bfloat16"),
        (["model_path=/no/such/export"], "model_path=/no/such/export: no such directory"),
        ([], "row 1: characters ['J'] are not residues of the tokenizer"),
        (["data.sequence_colum=seq"], "did you mean data.sequence_column? hydra_config/predict.yaml lists every key"),
    ],
)
def test_user_errors_end_in_one_line(tmp_path, overrides, message):
    make_export(tmp_path / "export")
    data = write_sequences(tmp_path / "seqs.parquet", ["MKTAYIAKQR", "MKJJ"], ids=["a", "b"])
    result = run_in_process(
        "predict.py", f"model_path={tmp_path / 'export'}", f"data.path={data}", f"output_dir={tmp_path / 'out'}",
        *overrides, expect_failure=True,
    )  # fmt: skip
    assert message in result.stderr
    assert not (tmp_path / "out" / "predictions.parquet").exists()


def test_pll_needs_a_masked_lm_head(tmp_path):
    make_export(tmp_path / "export", model_class=NVEsmForTokenClassification)
    data = write_sequences(tmp_path / "seqs.parquet", ["MKTAYIAKQR"])
    args = [f"model_path={tmp_path / 'export'}", f"data.path={data}", f"output_dir={tmp_path / 'out'}"]
    result = run_in_process("predict.py", *args, expect_failure=True)
    assert "holds a NVEsmForTokenClassification, which has no masked-LM head" in result.stderr
    assert "set pll=false for embeddings only" in result.stderr


def test_bfloat16_predictions_are_the_float32_ones_to_bf16_rounding(tmp_path):
    make_export(tmp_path / "export")
    data = write_sequences(tmp_path / "seqs.parquet", SEQUENCES)
    common = [f"model_path={tmp_path / 'export'}", f"data.path={data}", "data.max_seq_length=64", "token_budget=64"]
    for dtype in ("float32", "bfloat16"):
        run_script("predict.py", *common, f"dtype={dtype}", f"output_dir={tmp_path / dtype}")
    exact, rounded = (np.load(tmp_path / dtype / "embeddings.npy") for dtype in ("float32", "bfloat16"))
    assert rounded.dtype == np.float32  # written in float32 whatever the compute precision
    cosine = (exact * rounded).sum(1) / np.linalg.norm(exact, axis=1) / np.linalg.norm(rounded, axis=1)
    assert cosine.min() > 0.999 and not np.array_equal(exact, rounded)
    exact, rounded = (
        pq.read_table(tmp_path / d / "predictions.parquet")["mean_log_likelihood"] for d in ("float32", "bfloat16")
    )
    np.testing.assert_allclose(rounded.to_numpy(), exact.to_numpy(), atol=0.05)


def test_a_stock_esm2_checkpoint_predicts_what_the_hugging_face_model_computes(tmp_path, stock_checkpoint):
    """Converted on load (torch backend), with this recipe's tokenizer (the stock directory has none)."""
    path, hf_model = stock_checkpoint
    data = write_sequences(tmp_path / "seqs.parquet", SEQUENCES[:3])
    run_script("predict.py", f"model_path={path}", f"data.path={data}", f"output_dir={tmp_path / 'out'}")
    tokenizer = AutoTokenizer.from_pretrained("tokenizer")
    assert_predictions_are_one_at_a_time(tmp_path / "out", SEQUENCES[:3], hf_model, hf_model.esm, tokenizer)
    result = run_in_process(
        "predict.py", f"model_path={path}", f"data.path={data}", f"output_dir={tmp_path / 'te'}", "backend=te",
        expect_failure=True,
    )  # fmt: skip
    assert "is a stock ESM-2 checkpoint: it runs with backend=torch" in result.stderr


def test_a_published_amplify_checkpoint_predicts_what_its_weights_compute(tmp_path, published_checkpoint):  # noqa: F811
    path, _, _, weights = published_checkpoint
    config = tiny_config()
    config.backend = "torch"  # the reference runs on the CPU, also on a GPU machine
    model = NVAmplifyForMaskedLM(config)
    model.load_state_dict(weights)
    data = write_sequences(tmp_path / "seqs.parquet", SEQUENCES[:3])
    run_script("predict.py", f"model_path={path}", f"data.path={data}", f"output_dir={tmp_path / 'out'}")
    tokenizer = AutoTokenizer.from_pretrained("tokenizer_amplify")
    assert_predictions_are_one_at_a_time(tmp_path / "out", SEQUENCES[:3], model, model.amplify, tokenizer)
