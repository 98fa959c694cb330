# Generated package (remp.protogen). Do not edit.
