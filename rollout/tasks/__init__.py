"""Task families: synthetic math word problems (arithmetic), generated SWE repositories."""
