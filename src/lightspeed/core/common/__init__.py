"""What every feature of the core uses: rank helpers and agreement across ranks, byte sizes, counting samples,
argument checks, what core reads from a front end's strategy (``process``)."""
