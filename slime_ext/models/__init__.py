"""Model code shared by the embedded trainer and the teacher service (both import it; it
imports neither): the small-model factory (`factory`) and model references (`refs`: a
local directory, `factory:<preset>`, `bundled:student|teacher`)."""
