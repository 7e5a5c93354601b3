"""The inference mesh: tensor-parallel teacher forward, top-k outputs, weight loading."""
