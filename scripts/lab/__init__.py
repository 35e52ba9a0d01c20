"""Research questions about the correction, measured from the shipped package."""
