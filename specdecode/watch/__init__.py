"""Watching a decode token by token: each token coloured by how it came (drafted and accepted,
corrected, bonus, prompt lookup), in the terminal (`terminal`), a local web page (`server`), HTML
pages (`render`) and a headless-browser screenshot (`browser`); `watcher` loads and runs them."""
