"""The distributed layer: where each matrix's pieces live (layout), who orthogonalizes it (owner
plan), and how pieces travel to the owner and back (exchange). One mechanism for every backend;
backends differ only in the layout they describe."""
