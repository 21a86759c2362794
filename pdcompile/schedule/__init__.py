"""Schedules: the action IR (`ir`), what each schedule kind means (`kinds`), the generators of
compute orders (`generators`), lowering (`lower`: sends, receives, all-reduces, steps), the one
dependency function (`deps`), validation (`validate`) and `build`, which chains them."""
