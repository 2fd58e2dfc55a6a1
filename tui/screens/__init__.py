"""The chat app's screens: the chat itself and its dialogs."""
