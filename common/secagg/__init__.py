"""Secure aggregation's maths (issue 73), pure and tested without Flower.

The server needs only the *sum* of the sites' profile, vote histograms and marginals. Under secure
aggregation (Bonawitz et al. 2017, the full graph: the number of sites is small) each site sends a
vector that is uniform on its own, integers mod 2^b masked by pairwise masks (X25519 key agreement,
expanded by ChaCha20) and a self mask; the masks cancel in the sum, and Shamir shares of the mask
seeds let the survivors unmask the sum of the sites that sent a masked vector when others drop out.

- ``ring``: integers mod 2^b, and the b that holds the sum of every site at its public bound;
- ``masks``: keys, key agreement, the pseudorandom masks;
- ``shares``: Shamir shares of a site's secrets, sealed for one peer;
- ``protocol``: one site's side (``Participant``) and the server's arithmetic (``unmask``), as a
  state machine of four requests (advertise, share, mask, unmask) plus the consistency check that
  keeps a lying server from asking both of one site's secrets.

What a site adds to its vector (its share of the noise) is ``common.skellam``'s. The Flower rounds
are ``fedsyn_client.secagg_node`` (the node's side) and ``strategies.secagg_rounds`` (the server's).
"""
