"""Rendering: text (rich), HTML, figures. Rendering never computes attention."""
