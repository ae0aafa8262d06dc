"""The codon Markov chain behind the sanity data, and the best masked-codon loss any model can reach on it.

The L0 sanity set (``scripts/make_sanity_dataset.py``) is sampled from a first-order Markov chain over the 64 codons.
Each codon has ``N_SUCCESSORS`` = 3 possible next codons: one on a random cycle through all 64 codons (so the chain
is irreducible and every codon occurs) and two more drawn at random, with probabilities drawn from a Dirichlet.
The first codon is drawn from the chain's stationary distribution, so every position has the same codon frequencies.
A sequence's length (``MIN_CODONS``..``MAX_CODONS`` codons, uniform) does not depend on its codons.

Two numbers bracket what a masked LM can learn from it (nats, the unit of the training loss):

- ``unigram_entropy``: the entropy of the stationary codon distribution, the best loss without looking at the
  context (a model that learned only codon frequencies);
- ``optimal_masked_loss``: the Bayes-optimal loss under the recipe's own masking (``collator.MLMMasker``: 15% of the
  codons selected, of those 80% <MASK>, 10% a random codon, 10% unchanged; the loss counts the selected positions).
  At a selected position t the best prediction is the posterior ``P(x_t | visible tokens, t selected)``. The chain is
  the hidden state of an HMM whose emission is the masking: an unselected codon shows itself, a selected one shows
  <MASK>, a uniform random codon or itself. Forward-backward gives that posterior exactly; the expected loss is its
  negative log at the true codon, averaged over the selected positions of the validation set with the masks the
  collator draws for them (``seed``, epoch 0, the sample's row), as the validation loop sees them.

    python sanity_reference.py [--val data/sanity_val.parquet] [--seed 42]   # prints both numbers
"""

import argparse
import math

import numpy as np
from collator import IGNORE_INDEX, MLMMasker
from sequences import CODONS, FIRST_CODON_ID, MASK_ID


CHAIN_SEED = 20_250_716
N_STATES = len(CODONS)  # 64: state s is codon id FIRST_CODON_ID + s
N_SUCCESSORS = 3
DIRICHLET_ALPHA = 1.0
MIN_CODONS, MAX_CODONS = 30, 120
# The recipe's masking (collator.MLMMasker): fractions of the *selected* positions.
MASK_FRACTION, RANDOM_FRACTION = 0.8, 0.1  # the remaining 0.1 keep their codon


# ------------------------------------------------------------------------------------------------ the chain


def make_chain(seed: int = CHAIN_SEED) -> tuple[np.ndarray, np.ndarray]:
    """``(transition [64, 64], initial [64])``: a sparse codon chain and its stationary distribution."""
    rng = np.random.default_rng(seed)
    cycle = rng.permutation(N_STATES)
    transition = np.zeros((N_STATES, N_STATES))
    for position, state in enumerate(cycle):
        on_cycle = cycle[(position + 1) % N_STATES]
        others = rng.choice(np.setdiff1d(np.arange(N_STATES), [on_cycle]), N_SUCCESSORS - 1, replace=False)
        transition[state, np.concatenate([[on_cycle], others])] = rng.dirichlet([DIRICHLET_ALPHA] * N_SUCCESSORS)
    return transition, stationary_distribution(transition)


def stationary_distribution(transition: np.ndarray) -> np.ndarray:
    """The left eigenvector of eigenvalue 1, normalised (the chain is irreducible, so it is unique)."""
    values, vectors = np.linalg.eig(transition.T)
    vector = np.real(vectors[:, np.argmin(np.abs(values - 1.0))])
    return vector / vector.sum()


def sample_codon_states(transition: np.ndarray, initial: np.ndarray, n_codons: int, rng) -> np.ndarray:
    """One path of ``n_codons`` states (0..63)."""
    cumulative = np.cumsum(transition, axis=1)
    states = np.empty(n_codons, dtype=np.int64)
    states[0] = rng.choice(N_STATES, p=initial)
    for i, u in enumerate(rng.random(n_codons - 1), start=1):
        states[i] = min(int(np.searchsorted(cumulative[states[i - 1]], u, side="right")), N_STATES - 1)
    return states


def states_to_sequence(states) -> str:
    return "".join(CODONS[s] for s in states)


def entropy(distribution: np.ndarray) -> float:
    p = distribution[distribution > 0]
    return float(-(p * np.log(p)).sum())


def unigram_entropy(initial: np.ndarray) -> float:
    """Entropy (nats) of the codon frequencies: the stationary distribution, which every position follows."""
    return entropy(initial)


def entropy_rate(transition: np.ndarray, initial: np.ndarray) -> float:
    """H(x_t | x_{t-1}) (nats): the best left-to-right next-codon loss, for comparison."""
    return float(sum(initial[a] * entropy(transition[a]) for a in range(N_STATES)))


# ------------------------------------------------------------------------------------------ the masking as an HMM


def emissions(mlm_probability: float, n_states: int = N_STATES) -> tuple[np.ndarray, np.ndarray]:
    """``(any_position, selected)``: ``[n_states + 1, n_states]`` tables of P(visible | true state).

    Row ``v < n_states`` is "the visible token is state v", row ``n_states`` is "<MASK>". ``any_position`` is for a
    position the model cannot know to be selected (selected with ``mlm_probability``); ``selected`` is given that it
    is. A random replacement is uniform over the ``n_states`` codons (the collator's ``random_token_ids``) and may hit
    the true codon.
    """
    selected = np.full((n_states + 1, n_states), RANDOM_FRACTION / n_states)
    selected[n_states] = MASK_FRACTION
    keep = 1.0 - MASK_FRACTION - RANDOM_FRACTION
    selected[np.arange(n_states), np.arange(n_states)] += keep
    unselected = np.zeros((n_states + 1, n_states))
    unselected[np.arange(n_states), np.arange(n_states)] = 1.0
    return mlm_probability * selected + (1.0 - mlm_probability) * unselected, selected


def masked_posteriors(
    transition: np.ndarray, initial: np.ndarray, visible: np.ndarray, mlm_probability: float
) -> np.ndarray:
    """``[L, n_states]``: at each position t, P(x_t | all visible tokens, t selected) (forward-backward).

    ``visible``: the visible observation per codon position, a state 0..n_states-1 or ``n_states`` for <MASK>.
    """
    n_states = len(initial)
    any_position, selected = emissions(mlm_probability, n_states)
    length = len(visible)
    # forward[t] ∝ P(v_<t, x_t); backward[t] ∝ P(v_>t | x_t). Each is rescaled to sum 1: only ratios matter.
    forward = np.empty((length, n_states))
    backward = np.empty((length, n_states))
    forward[0] = initial
    for t in range(1, length):
        message = (forward[t - 1] * any_position[visible[t - 1]]) @ transition
        forward[t] = message / message.sum()
    backward[-1] = 1.0
    for t in range(length - 2, -1, -1):
        message = transition @ (any_position[visible[t + 1]] * backward[t + 1])
        backward[t] = message / message.sum()
    posterior = forward * backward * selected[visible]
    return posterior / posterior.sum(axis=1, keepdims=True)


def visible_states(masked_ids: np.ndarray) -> np.ndarray:
    """Codon token ids (and <MASK>) of the codon positions to HMM observations (states, ``N_STATES`` = <MASK>)."""
    ids = np.asarray(masked_ids)
    return np.where(ids == MASK_ID, N_STATES, ids - FIRST_CODON_ID)


def optimal_masked_loss(samples, transition: np.ndarray, initial: np.ndarray, masker: MLMMasker) -> float:
    """Mean over all selected positions of ``-log P(true codon | visible, selected)`` under ``masker``'s masks.

    ``samples``: dicts with ``input_ids`` (<CLS> codons <SEP>, as dataset.py encodes them), ``epoch`` and
    ``sample_index``, as the validation loader feeds them to the collator.
    """
    total, count = 0.0, 0
    for sample in samples:
        ids = np.asarray(sample["input_ids"])
        if (ids[1:-1] < FIRST_CODON_ID).any():
            raise ValueError("the reference assumes clean codons between <CLS> and <SEP> (no <UNK>)")
        masked, labels = masker(ids, sample["epoch"], sample["sample_index"])
        codons = slice(1, len(ids) - 1)  # <CLS> and <SEP> are never selected and carry no information
        posterior = masked_posteriors(transition, initial, visible_states(masked[codons]), masker.mlm_probability)
        chosen = np.flatnonzero(labels[codons] != IGNORE_INDEX)
        truth = ids[codons][chosen] - FIRST_CODON_ID
        total -= float(np.log(posterior[chosen, truth]).sum())
        count += len(chosen)
    return total / count


def reference_numbers(val_path, seed: int, mlm_probability: float = 0.15) -> dict:
    """Both numbers for a validation file, read and tokenized as the datamodule reads it (rows = sample_index)."""
    from datamodule import codon_masker
    from dataset import read_sequences

    transition, initial = make_chain()
    val = read_sequences(val_path)
    samples = [{"input_ids": val.tokens(i), "epoch": 0, "sample_index": i} for i in range(len(val))]
    return {
        "optimal_masked_loss": optimal_masked_loss(samples, transition, initial, codon_masker(seed, mlm_probability)),
        "unigram_entropy": unigram_entropy(initial),
        "entropy_rate": entropy_rate(transition, initial),
        "uniform": math.log(N_STATES),
    }


def main():
    from dataset import resolve_path

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--val", default="data/sanity_val.parquet")
    parser.add_argument("--seed", type=int, default=42, help="the datamodule's seed (data.seed), which masks val")
    parser.add_argument("--mlm-probability", type=float, default=0.15)
    args = parser.parse_args()
    numbers = reference_numbers(resolve_path(args.val), args.seed, args.mlm_probability)
    print(f"optimal masked-codon loss  {numbers['optimal_masked_loss']:.4f} nats (Bayes-optimal, seed {args.seed})")
    print(f"unigram entropy            {numbers['unigram_entropy']:.4f} nats (codon frequencies only)")
    print(f"entropy rate               {numbers['entropy_rate']:.4f} nats (left-to-right, for comparison)")
    print(f"uniform over 64 codons     {numbers['uniform']:.4f} nats")


if __name__ == "__main__":
    main()
